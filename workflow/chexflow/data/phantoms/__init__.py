"""The "mini-NIH" demo release: synthetic chest-radiograph phantoms in the NIH ChestX-ray14 layout.

:func:`release.make_release` samples whole patients (with their real label rows) from the NIH
label file shipped with torchxrayvision, renders one grey phantom radiograph per row whose 14
findings follow that row's labels, and writes the release exactly as NIH publishes it
(``images_NNN.tar.gz`` holding ``images/<Image Index>``, ``Data_Entry_2017_v2020.csv``,
``train_val_list.txt``, ``test_list.txt``, and ``BBox_List_2017.csv`` in the release's box-list
format, here holding where every finding of every image was drawn) plus ``release.json`` and
``SHA256SUMS`` (written
last: the directory is complete only once it exists). Everything is deterministic in ``seed``:
the same arguments give byte-identical files.

The phantoms are NOT radiographs. They carry real co-occurrence and prevalence of the labels
(because the rows are real) and a visual signature per finding of moderate strength, so that
a small CNN learns them to a mean AUROC between chance and perfect (measured: a 4-block CNN,
~100k parameters, 7 epochs on 4,500 training images at 64 px, reached a held-out mean of 0.90,
per label from 0.74 Infiltration to 0.97 Consolidation/Edema; a logistic regression on 16x16
pixels reaches 0.70, see tests/test_phantoms.py). Nodules are ~1 px wide below 64 px. Anatomy
(thorax size, heart, lungs, ribs, exposure) is drawn per patient, so follow-up images of one
patient look alike -- which is why splits must be patient-wise, as for the real data.

Modules, drawing first, packaging last:
  ``anatomy``   a patient's anatomy and one exposure's geometry (normalised anatomy frame)
  ``canvas``    the pixel canvas and the cheap shape primitives drawing uses
  ``findings``  the 14 findings' signatures (each a geometry change and/or a drawing)
  ``draw``      ``render``: one image from an anatomy and the findings present, and their regions
  ``release``   rows, patient split, archives, tables, checksums: ``make_release``
"""
