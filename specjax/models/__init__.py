"""Target and draft models: pure functions over params pytrees, with static configs."""

from specjax.models.config import Llama3RopeScaling, ModelConfig
from specjax.models.llama import ForwardOutput, Params

__all__ = ["ForwardOutput", "Llama3RopeScaling", "ModelConfig", "Params"]
