"""The engine core: requests, the scheduler and step, sampling, stopping, logprobs, step graphs."""
