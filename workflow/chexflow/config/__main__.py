"""``python -m chexflow.config``: config.yaml's JSON schema
(``> workflow/chexflow/schemas/config.schema.yaml``; a test keeps that file in sync)."""
import yaml

from chexflow.config import study_schema

print(yaml.safe_dump(study_schema(), sort_keys=False), end="")
