from services.worker.service import main

main()
