"""kiln.training.opd"""
