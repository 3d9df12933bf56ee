"""kvpath.bridge: trace replay in ns-3 and a flow-level model, the two-phase P/D serving simulation,
compare, calibrate, reports and sweeps."""
