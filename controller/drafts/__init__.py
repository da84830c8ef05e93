"""Speculative decoding on the controller: proposers guess each running request's next tokens
from token ids alone; the workers verify them (see ``drafter``)."""
