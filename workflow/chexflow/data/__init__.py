"""Data: the dataset source registry (``sources``), the verified downloader (``download``),
the phantom demo release (``phantoms``), the NIH ChestX-ray14 tables (``nih``) and the
Fashion-MNIST reader (``fashion_mnist``)."""
