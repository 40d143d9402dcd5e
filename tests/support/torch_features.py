"""What the torch under test lacks, where a test expects less of an older torch
(docs/install.md#torch-versions)."""

from __future__ import annotations

import torch

COMPILE_CHECK = hasattr(torch.compiler, "is_compiling")
"""torch 2.2 has no torch.compiler.is_compiling: ddpmon says that watching compiled models
is off, and Dynamo breaks the graph at its hooks there."""
