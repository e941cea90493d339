"""The batch scheduler (CoSine eq. 5-8): its LP problem, its solution, and the latency model it prices steps with."""
