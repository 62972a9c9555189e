"""The step forkserver's last preload: what it imported is kept out of the forked steps' collections.

Imported last by the forkserver (`step_launch.PRELOAD`), after the libraries and the code
location. `gc.freeze()` moves every object alive now into the collector's permanent generation,
so a forked step's full collections walk only the objects the step itself creates, not the ~0.5M
the server preloaded, and do not write to those objects' pages (which fork shares with the
server until written). Python's documentation recommends this before forking without exec.
"""

import gc

gc.collect()
gc.freeze()
