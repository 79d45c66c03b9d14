"""Self-contained HTML report (``render.render_report``); figures in ``plots``.

Import ``chexflow.report.render`` explicitly: this package module stays import-light.
"""
