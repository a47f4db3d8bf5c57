"""Models and the views of them that the strategies and the planner share.

``causal_lm`` builds the job's models (GPT-Neo presets, pretrained causal LMs) and their parameter groups;
``stages`` cuts a model into consecutive stages (Cyclic DP, the planner's stage sizes); ``units`` finds its
repeated blocks (FSDP2's units, per-block compile and checkpointing) and its layers (Streaming DiLoCo's strided
fragments).
"""

from .causal_lm import (
    PRESETS,
    ModelPreset,
    build_model,
    compile_blocks,
    count_parameters,
    enable_activation_checkpointing,
    is_pretrained,
    load_pretrained,
    max_positions,
    param_groups,
)

__all__ = ["PRESETS", "ModelPreset", "build_model", "compile_blocks", "count_parameters",
           "enable_activation_checkpointing", "is_pretrained", "load_pretrained", "max_positions", "param_groups"]
