"""kiln.teachers"""
