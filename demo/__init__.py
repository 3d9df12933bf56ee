"""``kvpath demo``: the whole story in one command. A small fabric, one workload under
ecmp, cc and cc with the best placement policy, each trace replayed in the bridge, one
table of measured against simulated, and the HTML report."""

from kvpath.demo.profiles import FULL, PROFILES, QUICK, Profile, Variant

__all__ = ["FULL", "PROFILES", "Profile", "QUICK", "Variant"]
