"""A discrete-event fleet simulator for Tandem's routing (see ``bench/sim/README.md``)."""
