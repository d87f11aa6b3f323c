"""kiln.training.sft"""
