"""Distributed training: one loop (trainer.py) behind one small distributed interface."""
