"""Prints whether SparseMoE may take the tiled MoE path in this process (MSTAR_MOE_TILED is read when
mstar.layers.moe is imported); run in a fresh process by test_moe_tiled.py."""

from mstar.layers import moe

if __name__ == "__main__":
    print(moe._TILED.usable)
