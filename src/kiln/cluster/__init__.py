"""kiln.cluster"""
