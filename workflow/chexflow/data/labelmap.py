"""Which finding of one dataset is which finding of another: the label map an external validation
scores a model's findings on another dataset's labels through.

Two names are the same finding when they are equal once case, spaces, ``_`` and ``-`` are set aside
(``Pleural_Thickening`` = ``pleural thickening``) or when ``SAME`` lists them together (NIH's
``Effusion`` is CheXpert's ``Pleural Effusion``). ``NOT_SAME`` records the near matches that are
deliberately not made, with the reason; every finding without a match is listed by :func:`match`
and shown in the report, never dropped silently.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# findings two datasets name differently (NIH ChestX-ray14, CheXpert; a CSV dataset may use either name)
SAME: tuple[tuple[str, ...], ...] = (
    ("Effusion", "Pleural Effusion"),
)
# near matches that are not the same finding: (one name, the other, why not)
NOT_SAME: tuple[tuple[str, str, str], ...] = (
    ("Mass", "Lung Lesion", "CheXpert's Lung Lesion covers masses and nodules together"),
    ("Nodule", "Lung Lesion", "CheXpert's Lung Lesion covers masses and nodules together"),
    ("Infiltration", "Lung Opacity", "CheXpert's Lung Opacity is any opacity, NIH's Infiltration one kind"),
    ("Pleural_Thickening", "Pleural Other", "CheXpert's Pleural Other is every pleural finding but effusion"),
)


def key(name: str) -> str:
    """The form names are compared in: lower case, runs of spaces, ``_`` and ``-`` as one space."""
    return re.sub(r"[\s_\-]+", " ", name).strip().casefold()


_GROUP = {key(n): i for i, group in enumerate(SAME) for n in group}


def same(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same finding."""
    ka, kb = key(a), key(b)
    return ka == kb or (ka in _GROUP and _GROUP.get(kb) == _GROUP[ka])


@dataclass(frozen=True)
class Match:
    pairs: tuple[tuple[str, str], ...]      # (the model's finding, the dataset's finding), model order
    model_only: tuple[str, ...]             # the model's findings the dataset does not label
    data_only: tuple[str, ...]              # the dataset's findings the model does not predict
    near: tuple[tuple[str, str, str], ...]  # unmatched near matches of NOT_SAME present here, with why

    def record(self) -> dict:
        return {"pairs": [list(p) for p in self.pairs], "model_only": list(self.model_only),
                "data_only": list(self.data_only), "near_not_matched": [list(n) for n in self.near]}


def match(model: Sequence[str], data: Sequence[str]) -> Match:
    """The model's findings matched to the dataset's (each at most once; a name that matches two is
    an error naming them)."""
    pairs = []
    for m in model:
        found = [d for d in data if same(m, d)]
        if len(found) > 1:
            raise ValueError(f"finding {m!r} matches {found} of the dataset: the label map is ambiguous")
        if found:
            pairs.append((m, found[0]))
    used = [d for _, d in pairs]
    if len(set(used)) != len(used):
        raise ValueError(f"the dataset's finding(s) {sorted({d for d in used if used.count(d) > 1})} match two of the "
                         "model's findings: the label map is ambiguous")
    model_only = tuple(m for m in model if m not in {p[0] for p in pairs})
    data_only = tuple(d for d in data if d not in used)
    near = tuple((a, b, why) for a, b, why in NOT_SAME for m in model_only for d in data_only
                 if {key(m), key(d)} == {key(a), key(b)})
    return Match(tuple(pairs), model_only, data_only, near)
