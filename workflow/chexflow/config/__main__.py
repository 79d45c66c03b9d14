"""config.yaml's JSON schema: ``python -m chexflow.config > workflow/chexflow/schemas/config.schema.yaml``."""
import yaml

from chexflow.config import study_schema

print(yaml.safe_dump(study_schema(), sort_keys=False), end="")
