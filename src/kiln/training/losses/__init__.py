"""kiln.training.losses"""
