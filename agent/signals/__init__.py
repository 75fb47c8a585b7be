"""Kernel signals for the agent: exec and TCP events from BCC tracepoints, attributed
to job slots, with a /proc fallback when BPF is unavailable.

Import cost matters: this package never imports bcc (only the short-lived loader
process does). See docs/bpf.md.
"""

from agent.signals.model import ConnEvent, EndpointSignals, ExecEvent, Gap, NodeSignals, SlotSignals
from agent.signals.sensor import LoadError, Sensor

__all__ = ["Sensor", "LoadError", "ExecEvent", "ConnEvent", "Gap", "SlotSignals", "EndpointSignals", "NodeSignals"]
