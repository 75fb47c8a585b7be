"""Kernel signals for the agent: exec and TCP events from BCC tracepoints, attributed
to job slots, with a /proc fallback when BPF is unavailable.

Modules (one concept each):

* :mod:`agent.signals.sensor`    Sensor: the loop thread's API (life cycle, slots, endpoints, queries)
* :mod:`agent.signals.attach`    loading the program through the loader process; the fds it hands back
* :mod:`agent.signals.loader`    the short-lived process that imports bcc, compiles and attaches
* :mod:`agent.signals.polling`   the poll thread: perf events and counter samples, posted to the loop
* :mod:`agent.signals.history`   the sampled counters per slot and endpoint, windowed rates, the queries
* :mod:`agent.signals.procscan`  degraded mode: execs and stalled sockets found by scanning /proc
* :mod:`agent.signals.decode`    perf records decoded into ExecEvent and ConnEvent
* :mod:`agent.signals.abi`       the C structs and map keys of bpf/sensor.c, mirrored once
* :mod:`agent.signals.bpfsys`    maps and perf buffers through libbcc_bpf, without BCC
* :mod:`agent.signals.procfs`    /proc readers (node TCP counters, processes, sockets)
* :mod:`agent.signals.model`     the events and signals handed to the rest of the agent
* :mod:`agent.signals.check`     ``millwright bpf check`` and the loader's preflight

Import cost matters: this package never imports bcc (only the short-lived loader
process does). See docs/bpf.md.
"""

from agent.signals.attach import LoadError
from agent.signals.model import ConnEvent, EndpointSignals, ExecEvent, Gap, NodeSignals, SlotSignals
from agent.signals.sensor import Sensor

__all__ = ["Sensor", "LoadError", "ExecEvent", "ConnEvent", "Gap", "SlotSignals", "EndpointSignals", "NodeSignals"]
