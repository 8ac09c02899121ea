"""What measures and shows the package: the demo, the profiler's analysis and the ops' cost
formulas."""
