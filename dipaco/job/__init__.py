"""The job: prepare the data and the router, run the rounds, the dense baseline, evaluate, report."""
