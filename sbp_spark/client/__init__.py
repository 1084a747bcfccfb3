"""sbp_spark.client"""
