from shoal.consumer.cli import main

main()
