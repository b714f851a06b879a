"""Every configuration of phasekv but the theory's (`phasekv.theory.config`), by concern:

  fields.py  the one field validator: `spec` (a field with its bounds or allowed values), `check_fields`,
             `from_section`
  files.py   strict YAML and JSON parsing of config files and `--set a.b=value` overrides
  model.py   compressor options (`CompressorOptions` and their registry), the phasekv model (`ModelConfig`)
             and transformers' models (`TransformersModelConfig`)
  run.py     the run sections (`DataConfig`, `TrainConfig`, `EvalConfig`), an audit's settings (`audit_config`,
             `AuditPlan`) and the resolved `Experiment`

Every config is a dataclass of plain values, validated in one place and one style (fields.py); every error is a
`ValueError` naming the field as `section.field`.  The package imports nothing else of phasekv (it is the bottom
layer); its names are all importable from `phasekv.config`.
"""

from phasekv.config.fields import check_fields, from_section, short, spec
from phasekv.config.files import (
    MAX_CONFIG_BYTES,
    MAX_NESTING,
    apply_overrides,
    load_yaml,
    parse_json,
    parse_override,
    parse_yaml,
)
from phasekv.config.model import (
    LAYER_KINDS_BUILTIN,
    ROPE_PARTS,
    CompressorOptions,
    ModelConfig,
    TransformersModelConfig,
    compressor_names,
    model_config_from_dict,
    register_options,
    route_compressor_keys,
)
from phasekv.config.run import (
    AUDIT_DEFAULTS,
    DEFAULT_CONDITIONS,
    EVAL_PROTOCOLS,
    PROTOCOLS,
    REPORT_TO,
    AuditPlan,
    DataConfig,
    EvalConfig,
    Experiment,
    TrainConfig,
    audit_config,
)

__all__ = ["AUDIT_DEFAULTS", "DEFAULT_CONDITIONS", "EVAL_PROTOCOLS", "LAYER_KINDS_BUILTIN", "MAX_CONFIG_BYTES",
           "MAX_NESTING", "PROTOCOLS", "REPORT_TO", "ROPE_PARTS", "AuditPlan", "CompressorOptions", "DataConfig",
           "EvalConfig", "Experiment", "ModelConfig", "TrainConfig", "TransformersModelConfig", "apply_overrides",
           "audit_config", "check_fields", "compressor_names", "from_section", "load_yaml", "model_config_from_dict",
           "parse_json", "parse_override", "parse_yaml", "register_options", "route_compressor_keys", "short", "spec"]
