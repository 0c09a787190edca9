"""Build the compiled CPU KDA kernel now: `python -m k3.ops.kda.build` (`make` runs it while installing).

Exit status 0 either way (the torch ops are the fallback), with one line saying which path `chunk_kda` will take.
"""

from k3.ops.kda import cpu

if __name__ == "__main__":
    module, why = cpu.build()
    print("k3: compiled KDA kernel ready" if module is not None
          else f"k3: compiled KDA kernel unavailable, chunk_kda uses the torch ops ({why})")
