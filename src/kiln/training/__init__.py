"""kiln.training"""
