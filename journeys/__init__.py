"""journeys: event logs -> journeys -> conversion transformer -> scores -> attribution."""

__version__ = "0.1.0"
