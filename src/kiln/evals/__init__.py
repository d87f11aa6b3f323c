"""kiln.evals"""
