"""Build the compiled CPU kernels now: `python -m k3.ops.build` (`make` runs it while installing).

Exit status 0 either way (the torch ops are the fallback), with one line per kernel saying which path serves.
"""

from k3.ops import compiled

if __name__ == "__main__":
    for name in compiled.KERNELS:
        module, why = compiled.build(name)
        print(f"k3: compiled {name} kernel ready" if module is not None
              else f"k3: compiled {name} kernel unavailable, the torch ops serve ({why})")
