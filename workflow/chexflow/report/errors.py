"""The report's one error type (``render`` and the section views raise it)."""


class ReportInputError(ValueError):
    """An input of the report is missing or malformed; the message names the file."""
