"""kiln.adapters"""
