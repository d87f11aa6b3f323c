"""kiln.training.core"""
