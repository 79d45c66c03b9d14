"""Studies around the main run: pretraining scaling, fine-tuning sweep, init ablation."""
