"""kiln.training.grpo"""
