"""A small package shaped like vLLM's config and v1 modules, for ApiView tests."""

from __future__ import annotations

import textwrap
import zipfile
from pathlib import Path

FILES = {
    "fakevllm/__init__.py": """
        from fakevllm.version import __version__
        MODULE_ATTRS = {"Engine": ".engine:Engine", "Other": "fakevllm.engine.Engine"}

        def __getattr__(name):
            raise AttributeError(name)
    """,
    "fakevllm/version.py": """
        __version__ = "9.9.9"
    """,
    "fakevllm/_version.py": """
        __version__ = version = "9.9.9"
    """,
    "fakevllm/config/__init__.py": """
        from fakevllm.config.scheduler import SchedulerConfig
        from .cache import CacheConfig as CacheConfig
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from fakevllm.engine import Engine
    """,
    "fakevllm/config/utils.py": """
        from pydantic.dataclasses import dataclass as _pyd

        def config(cls):
            return _pyd(cls)
    """,
    "fakevllm/config/scheduler.py": """
        from dataclasses import InitVar, field
        from typing import ClassVar
        from fakevllm.config.utils import config

        @config
        class SchedulerConfig:
            max_model_len: InitVar[int]
            is_encoder_decoder: InitVar[bool]
            max_num_seqs: int = 128
            cuda_graph_sizes: list[int] = field(default_factory=list)
            internal: int = field(default=0, init=False)
            async_scheduling: bool | None = None
            registry: ClassVar[dict] = {}

            def __post_init__(self, max_model_len: int, is_encoder_decoder: bool) -> None:
                self.max_len = max_model_len
    """,
    "fakevllm/config/cache.py": """
        from dataclasses import dataclass, KW_ONLY

        @dataclass
        class BaseCache:
            block_size: int = 16

        @dataclass
        class CacheConfig(BaseCache):
            gpu_memory_utilization: float = 0.9
            _: KW_ONLY
            enable_prefix_caching: bool = True
    """,
    "fakevllm/engine.py": """
        class Base:
            def __init__(self, vllm_config, *, log_stats: bool = False):
                self.vllm_config = vllm_config

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None, unique_reply_rank=None):
                result = [method]
                return result[0] if unique_reply_rank is not None else result

        class Engine(Base):
            @staticmethod
            def helper(x, y=2):
                return x + y

            def execute_model(self, scheduler_output, non_block=False):
                return None

            @classmethod
            def required_layout(cls, vllm_config):
                return None

            def renamed_self(engine, method, *args):
                return method
    """,
    "fakevllm/moved.py": """
        def planner(vllm_config, kv_cache_groups, available_memory):
            return available_memory
    """,
    "fakevllm/utils.py": """
        from fakevllm.moved import planner
        from fakevllm import engine
        LIMIT: int = 3
    """,
}


def write_tree(root: Path) -> Path:
    """Write the package under ``root`` and return ``root``."""
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    info = root / "fakevllm-9.9.9.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakevllm\nVersion: 9.9.9\n")
    return root


def write_wheel(root: Path, wheel: Path) -> Path:
    """Zip the tree written by ``write_tree`` as a wheel file."""
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(root).as_posix())
    return wheel
