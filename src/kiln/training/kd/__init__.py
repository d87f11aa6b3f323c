"""kiln.training.kd"""
