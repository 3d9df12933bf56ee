"""What kvpath's HTTP services share (the proxy and the reservation service): the bearer
token check, the request-body limit and the error answers that name the bad field."""
