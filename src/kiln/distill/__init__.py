"""kiln.distill"""
