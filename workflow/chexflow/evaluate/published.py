"""Published ChestX-ray14 AUROCs that chexflow's results are compared with.

All per-label tables use the 14 NIH label spellings of ``chexflow.data.nih.LABELS``
(``Pleural_Thickening`` with an underscore). Means are computed from the per-label
values, never typed in separately.

Caveat shown in the report: none of these numbers were measured on the same test set, and
they do not all come from the same kind of split. Each result names its own (``split``):
CheXNet split ChestX-ray14 at random (patient-wise) itself; Wang et al.'s table and the best
published results on the official test list (EVA-X, Medical MAE, XProtoNet) use the official NIH
lists (train_val_list.txt / test_list.txt); arnoweng/CheXNet randomly split the
data 70/10/20; Zech's reproduction uses the split in its own ``nih_labels.csv``. Differences of
a few hundredths are within split-to-split variation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping


@dataclass(frozen=True)
class PublishedResult:
    """One published result: per-label AUROCs (may be empty) and/or a mean."""

    key: str
    name: str
    citation: str
    url: str
    per_label: Mapping[str, float] = field(default_factory=dict)
    reported_mean: float | None = None
    note: str = ""
    split: str = ""                   # the test set the numbers were measured on
    pretraining: str = ""             # what the network was pretrained on before ChestX-ray14

    def get(self, label: str, default: float | None = None) -> float | None:
        """Per-label AUROC like ``dict.get`` (``default`` for labels without a value)."""
        return self.per_label.get(label, default)

    @property
    def mean(self) -> float | None:
        """Mean over the per-label values when given, else the reported mean."""
        if self.per_label:
            return sum(self.per_label.values()) / len(self.per_label)
        return self.reported_mean

    def mean_over(self, labels: Iterable[str]) -> float | None:
        """Mean of the published per-label AUROCs over ``labels`` (the labels a run's own mean is
        taken over); None when a label has no published value or none are given."""
        values = [self.per_label.get(label) for label in labels]
        if not values or any(v is None for v in values):
            return None
        return sum(values) / len(values)


CHEXNET_AUROC: Mapping[str, float] = MappingProxyType({
    "Atelectasis": 0.8094,
    "Cardiomegaly": 0.9248,
    "Effusion": 0.8638,
    "Infiltration": 0.7345,
    "Mass": 0.8676,
    "Nodule": 0.7802,
    "Pneumonia": 0.7680,
    "Pneumothorax": 0.8887,
    "Consolidation": 0.7901,
    "Edema": 0.8878,
    "Emphysema": 0.9371,
    "Fibrosis": 0.8047,
    "Pleural_Thickening": 0.8062,
    "Hernia": 0.9164,
})

WANG2017_AUROC: Mapping[str, float] = MappingProxyType({
    "Atelectasis": 0.7003,
    "Cardiomegaly": 0.8100,
    "Effusion": 0.7585,
    "Infiltration": 0.6614,
    "Mass": 0.6933,
    "Nodule": 0.6687,
    "Pneumonia": 0.6580,
    "Pneumothorax": 0.7993,
    "Consolidation": 0.7032,
    "Edema": 0.8052,
    "Emphysema": 0.8330,
    "Fibrosis": 0.7859,
    "Pleural_Thickening": 0.6835,
    "Hernia": 0.8717,
})

CHEXNET = PublishedResult(
    key="chexnet",
    name="CheXNet",
    citation=("Rajpurkar P, Irvin J, et al. CheXNet: Radiologist-Level Pneumonia Detection "
              "on Chest X-Rays with Deep Learning. arXiv:1711.05225 (2017), Table 2."),
    url="https://arxiv.org/abs/1711.05225",
    per_label=CHEXNET_AUROC,
    reported_mean=0.841,
    note="DenseNet-121, ImageNet-pretrained.",
    split="random patient-wise split by the authors (train 70% / validation 10% / test 20%)",
    pretraining="ImageNet (supervised; DenseNet-121)",
)

WANG2017 = PublishedResult(
    key="wang2017",
    name="Wang et al. 2017",
    citation=("Wang X, Peng Y, Lu L, Lu Z, Bagheri M, Summers RM. ChestX-ray8: Hospital-scale "
              "Chest X-ray Database and Benchmarks on Weakly-Supervised Classification and "
              "Localization of Common Thorax Diseases. CVPR 2017 (arXiv:1705.02315)."),
    url="https://arxiv.org/abs/1705.02315",
    per_label=WANG2017_AUROC,
    note=("ResNet-50 baseline, 14-label ChestX-ray14 results of the revised arXiv version "
          "(the CheXNet paper tabulates an earlier version's values, e.g. Atelectasis 0.716)."),
    split="the official NIH split lists (train_val_list.txt / test_list.txt, patient-wise)",
    pretraining="ImageNet (supervised; ResNet-50)",
)

ARNOWENG = PublishedResult(
    key="arnoweng",
    name="arnoweng/CheXNet (reimplementation)",
    citation=("Weng X, Zhuang N, Tian J, Liu Y. CheXNet for Classification and Localization "
              "of Thoracic Diseases (PyTorch reimplementation). GitHub: arnoweng/CheXNet."),
    url="https://github.com/arnoweng/CheXNet",
    reported_mean=0.847,
    note="Mean of their 'improved model' as stated in the README.",
    split="random split by the authors (70/10/20), not the official NIH lists",
    pretraining="ImageNet (supervised; DenseNet-121)",
)

ZECH = PublishedResult(
    key="zech",
    name="Zech, reproduce-chexnet",
    citation="Zech J. reproduce-chexnet. GitHub repository (2018): jrzech/reproduce-chexnet.",
    url="https://github.com/jrzech/reproduce-chexnet",
    reported_mean=0.836,
    note="Mean of the 14 AUROCs in the 2018 pretrained/aucs.csv (0.8358).",
    split="the repository's own patient-wise split (nih_labels.csv), not the official NIH lists",
    pretraining="ImageNet (supervised; DenseNet-121)",
)

OFFICIAL_SPLIT = "the official NIH split lists (train_val_list.txt / test_list.txt: 25,596 test images, patient-wise)"

# The best published results on the official test list, mean AUROC over the 14 findings as reported
# (per-finding values are left out where not checked against the source).
EVA_X = PublishedResult(
    key="eva_x",
    name="EVA-X-B (ViT-B/16)",
    citation=("Yao J, Wang X, Song Y, Zhao H, Ma J, Chen Y, Liu W, Wang B. EVA-X: a foundation model for general "
              "chest X-ray analysis with self-supervised learning. npj Digital Medicine (2025); "
              "arXiv:2405.05237 (2024)."),
    url="https://arxiv.org/abs/2405.05237",
    reported_mean=0.835,
    note="Mean AUROC 83.5 as reported for ChestX-ray14 in the authors' repository (hustvl/EVA-X), 224 px.",
    split=OFFICIAL_SPLIT,
    pretraining=("self-supervised on about 520k unlabelled chest X-rays merged from public datasets (masked image "
                 "modelling against an MGCA ViT-B/16 tokenizer, with contrastive learning)"),
)

MEDICAL_MAE = PublishedResult(
    key="medical_mae",
    name="Medical MAE (ViT-S/16)",
    citation=("Xiao J, Bai Y, Yuille A, Zhou Z. Delving into Masked Autoencoders for Multi-Label Thorax Disease "
              "Classification. WACV 2023 (arXiv:2210.12843)."),
    url="https://arxiv.org/abs/2210.12843",
    reported_mean=0.823,
    note="Mean AUROC 82.3 as reported in the authors' repository (lambert-x/medical_mae), 224 px.",
    split=OFFICIAL_SPLIT,
    pretraining="MAE (self-supervised) on 266,340 chest X-rays of ChestX-ray14 and CheXpert",
)

XPROTONET = PublishedResult(
    key="xprotonet",
    name="XProtoNet",
    citation=("Kim E, Kim S, Seo M, Yoon S. XProtoNet: Diagnosis in Chest Radiography with Global and Local "
              "Explanations. CVPR 2021."),
    url=("https://openaccess.thecvf.com/content/CVPR2021/html/Kim_XProtoNet_Diagnosis_in_Chest_Radiography_With_"
         "Global_and_Local_Explanations_CVPR_2021_paper.html"),
    reported_mean=0.822,
    note="Prototype-based, interpretable classifier; mean AUROC 0.822.",
    split=OFFICIAL_SPLIT,
    pretraining="ImageNet (supervised; DenseNet-121 feature extractor)",
)

REPRODUCTIONS: tuple[PublishedResult, ...] = (ARNOWENG, ZECH)

OFFICIAL_SPLIT_STATE_OF_THE_ART: tuple[PublishedResult, ...] = (EVA_X, MEDICAL_MAE, XPROTONET)

PUBLISHED: tuple[PublishedResult, ...] = (CHEXNET, WANG2017, *REPRODUCTIONS, *OFFICIAL_SPLIT_STATE_OF_THE_ART)

SPLIT_CAVEAT = (
    "The published numbers come from different test sets: CheXNet and the two reimplementations split "
    "ChestX-ray14 themselves (random patient-wise splits), Wang et al., EVA-X, Medical MAE and XProtoNet used "
    "the official NIH lists; none of them was measured on the images tested here. Each reference's split and "
    "pretraining are named in the table. Use them as a reference point, not as a like-for-like comparison."
)
