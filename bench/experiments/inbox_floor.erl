%% Experiment (not part of the harness): what does convoy's inbox cost the
%% receiving node beside the least a process delivering the same batches can?
%% Node A sends prepared batches of 1,000 casts (`{'$gen_cast', Event}', the
%% harness's event shape) to one `gen_server' with an off-heap mailbox on peer B,
%% as convoy's wire batches, as fast as the connection takes them:
%%   inbox  to B's convoy inbox (`convoy_inbox_1'), which checks and delivers them;
%%   floor  to a bare process on B that takes the same batch term apart and sends
%%          each entry with `!': no checks, no counts.
%% Per run: casts a second (first batch sent to the server's count of all of
%% them) and node B's CPU per cast (`statistics(runtime)' on B). The ways
%% alternate on the same nodes; medians at the end.
%%
%% Run from the repository, with the harness compiled (`rebar3 as bench compile'):
%%   erlc -o /tmp bench/experiments/inbox_floor.erl
%%   erl -sname if -noshell -pa _build/bench/lib/convoy/ebin \
%%       -pa _build/bench/lib/convoy/bench -pa /tmp -s inbox_floor run -s init stop
-module(inbox_floor).

-export([run/0]).
%% Run on the peer.
-export([floor/0]).

-define(RUNS, 6).
-define(BATCHES, 1280).
-define(BATCH, 1000).

run() ->
    {ok, _} = application:ensure_all_started(convoy),
    Rows = [[{Way, on_fresh_peer(Way)} || Way <- [inbox, floor]] || _ <- lists:seq(1, ?RUNS)],
    io:format("~b batches of ~b casts to one off-heap gen_server on node B, ~b runs "
              "alternated, each on a new peer~n", [?BATCHES, ?BATCH, ?RUNS]),
    [begin
         Runs = [proplists:get_value(Way, Row) || Row <- Rows],
         io:format("  ~-6s ~.2f M casts/s, node B ~b ns per cast (medians; per run: ~s)~n",
                   [Way, median([R || {R, _} <- Runs]), round(median([C || {_, C} <- Runs])),
                    lists:join(", ", [io_lib:format("~.2f M ~b ns", [R, round(C)])
                                      || {R, C} <- Runs])])
     end || Way <- [inbox, floor]],
    ok.

on_fresh_peer(Way) ->
    Dirs = [filename:dirname(code:which(M)) || M <- [convoy, convoy_bench_gen, ?MODULE]],
    {ok, Peer, B} = peer:start_link(#{name => peer:random_name(if_b),
                                      args => lists:append([["-pa", D] || D <- Dirs])}),
    {ok, _} = erpc:call(B, application, ensure_all_started, [convoy]),
    _ = erpc:call(B, erlang, spawn_opt, [?MODULE, floor, [], [{message_queue_data, off_heap}]]),
    timer:sleep(300),
    Result = measure(Way, B),
    peer:stop(Peer),
    erlang:garbage_collect(),
    Result.

measure(Way, B) ->
    Casts = ?BATCHES * ?BATCH,
    {ok, Server} = erpc:call(B, gen_server, start,
                             [convoy_bench_gen, {Casts, self()},
                              [{spawn_opt, [{message_queue_data, off_heap}]}]]),
    Batches = [convoy_wire:batch(node(), [{Server, {'$gen_cast', event(K * ?BATCH + I)}}
                                          || I <- lists:seq(1, ?BATCH)])
               || K <- lists:seq(0, ?BATCHES - 1)],
    To = case Way of
             inbox -> {convoy_wire:inbox_name(1), B};
             floor -> {inbox_floor_deliverer, B}
         end,
    timer:sleep(100),
    {Cpu0, _} = erpc:call(B, erlang, statistics, [runtime]),
    T0 = erlang:monotonic_time(),
    [To ! Batch || Batch <- Batches],
    receive {casts_done, Server} -> ok end,
    T1 = erlang:monotonic_time(),
    {Cpu1, _} = erpc:call(B, erlang, statistics, [runtime]),
    ok = erpc:call(B, gen_server, stop, [Server]),
    {Casts / erlang:convert_time_unit(T1 - T0, native, microsecond),
     (Cpu1 - Cpu0) * 1.0e6 / Casts}.

event(Id) -> {event, Id, <<"user-42">>, #{k => Id}}.

median(L) -> lists:nth((length(L) + 1) div 2, lists:sort(L)).

%% @doc The floor's deliverer on the peer: each batch's entries sent with `!'.
-spec floor() -> no_return().
floor() ->
    register(inbox_floor_deliverer, self()),
    floor_loop().

floor_loop() ->
    receive {_Tag, _Vsn, batch, _From, Entries} -> deliver(Entries) end,
    floor_loop().

deliver([]) -> ok;
deliver([{To, Msg} | Rest]) -> To ! Msg, deliver(Rest).
