"""zspeed.compress"""
