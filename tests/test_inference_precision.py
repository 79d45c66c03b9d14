"""Inference computes float32 as float32 (chexflow.train.models.ieee_fp32), wherever it runs.

On CUDA PyTorch lets cuDNN convolutions use TF32 by default: on an H200 a fine-tuned ResNet's
probabilities moved by up to 8e-4 from the CPU's (bench/results/gpu_tests-20261128-h200.log,
test_predict_on_cuda_gives_the_cpu_probabilities). Evaluation, predict and Grad-CAM run their
forward passes with TF32 off; these tests watch the flags from inside the model's forward on CPU
(the flags are global, so the branch is the same), with TF32 switched on around the call.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chexflow.data import manifest as manifest_mod
from chexflow.evaluate import run as evaluate
from chexflow.evaluate import saliency
from chexflow.predict.model import Predictor, Preprocess
from chexflow.train.models import build_model


@pytest.fixture
def tf32_on():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    yield
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True), \
        "the flags were not restored"
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _watched_model(n_labels: int = 14):
    model = build_model("resnet18", in_channels=1, num_outputs=n_labels).eval()
    seen: list[tuple[bool, bool]] = []
    model.register_forward_pre_hook(
        lambda m, args: seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)))
    return model, seen


def test_evaluation_scores_without_tf32(tf32_on, demo_manifest):
    model, seen = _watched_model()
    shards = manifest_mod.split_shards(demo_manifest, "test")
    scores, targets, _, images = evaluate.predict(model, shards, crop=32, batch_size=16, device="cpu")
    assert scores.shape == targets.shape and len(images) == scores.shape[0] > 16   # more than one batch
    assert len(seen) >= 2 and set(seen) == {(False, False)}


def test_predict_probabilities_without_tf32(tf32_on):
    model, seen = _watched_model(3)
    predictor = Predictor(model=model, labels=("A", "B", "C"), thresholds={}, run_id="x",
                          preprocess=Preprocess(stored_size=40, crop=32), dataset="nih")
    probs = predictor.probabilities(torch.randint(0, 256, (2, 40, 40), dtype=torch.uint8))
    assert probs.shape == (2, 3) and np.all((probs > 0) & (probs < 1))
    assert seen == [(False, False)]


def test_gradcam_without_tf32(tf32_on):
    model, seen = _watched_model(3)
    maps = saliency.gradcam(model, model.layer3, torch.randn(3, 1, 32, 32), [0, 1, 2], batch_size=2)
    assert maps.shape == (3, 32, 32) and np.all(maps >= 0)
    assert len(seen) == 2 and set(seen) == {(False, False)}
