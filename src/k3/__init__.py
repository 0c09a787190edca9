"""k3: the Kimi K3 model architecture in PyTorch.

The model is documented in `docs/architecture.md` of the repository (cited as "§n" throughout the code); the
README explains installation, the command line and the demos.

Public API::

    import k3
    config = k3.K3Config.from_preset("k3-tiny")
    model = k3.K3ForCausalLM(config)                     # or k3.K3ForCausalLM.from_pretrained(path)
    ids = k3.generate(model, prompt_ids, max_new_tokens=50)
    tokenizer = k3.K3Tokenizer.load(path)                 # tiktoken format
    processor = k3.K3Processor.load(path)                 # images and video (needs the `vision` extra: Pillow)
"""

from k3.config import K3Config
from k3.inference import generate
from k3.model import K3ForCausalLM, K3ForConditionalGeneration
from k3.tokenizer import K3Tokenizer

__all__ = ["K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "K3Processor", "K3Tokenizer", "generate"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # K3Processor needs Pillow, an optional extra: imported on first use so that `import k3` works without it
    if name == "K3Processor":
        try:
            from k3.vision.processor import K3Processor
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"k3.K3Processor needs {e.name!r}: pip install 'kimi-k3[vision]'") from e
        return K3Processor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
