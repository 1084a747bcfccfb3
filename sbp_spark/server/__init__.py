"""sbp_spark.server"""
