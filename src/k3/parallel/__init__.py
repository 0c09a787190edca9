"""Scale-out: parallelism applied from outside the model (mesh, FSDP2, expert parallelism, planning)."""
