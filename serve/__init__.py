"""zspeed.serve"""
