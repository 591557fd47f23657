from shoal.operator.cli import main

main()
