"""What moewatch reads of NCCL's own measurements: the NCCL Inspector profiler plugin's output
(`inspector.py`: JSON lines and the Prometheus textfile form) turned into all-to-all time in a
Window (`a2a.py`), and DeepEP low-latency's wait-cost statistics (`deepep.py`). Torch-free; no
source to poll and no actuator of its own: the readers are used where windows are read or built."""
