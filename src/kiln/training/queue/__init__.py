"""kiln.training.queue"""
