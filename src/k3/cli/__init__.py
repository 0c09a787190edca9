"""The `k3` command line.

    k3 info PRESET_OR_PATH [--json]                 architecture report (meta device, no memory)
    k3 diagram PRESET_OR_PATH -o FILE.{svg,png,pdf}  the architecture in one picture
    k3 ablate (--budget-minutes M | --flops F) --out DIR [--variants ...]   K3 vs K2 at equal training FLOPs
    k3 generate CHECKPOINT --prompt TEXT [--image FILE] [...]   stream a continuation (captions with --image)
    k3 serve CHECKPOINT [--host 127.0.0.1] [--port 8000] [--api-key KEY] [...]   OpenAI-compatible HTTP server
    torchrun --nproc_per_node N -m k3 serve CHECKPOINT --ep N   the same, the routed experts split over N processes
    k3 train [--task text|shapes] [--preset P] [--data PATH] (--steps N | --minutes M) [--out DIR] [...]
    k3 train --resume --out DIR [--steps N] [--lr LR] [...]   continue (or extend) a run with its own options
    k3 plan PRESET_OR_PATH --gpus N --gpu-memory GIB [--ep N] [...]   training memory per GPU on a mesh
    k3 plan PRESET_OR_PATH --serve [--experts mxfp4|bf16] [--context N] [--batch B] [--gpus N --gpu-memory GIB |
            --host-memory GIB]                    serving memory: weights, caches, fits?
    python -m k3 ...                                 the same

Every expected failure is one line on stderr, `k3 <cmd>: error: <message>`, with exit status 2 for a usage error
(a bad option, a missing or invalid input) and 1 for a failed run (a full disk, a diverged run); Ctrl-C exits with
130 and SIGTERM stops training with a checkpoint (exit 143). `k3 --debug <cmd>` shows the traceback instead.
"""

from k3.cli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, Failure, UsageError
from k3.cli.parser import main
from k3.cli.runs import TextStreamer, caption_accuracy_line

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "Failure", "TextStreamer", "UsageError",
           "caption_accuracy_line", "main"]
