%% Micro-benchmark of an inbox's delivery: the time it takes per delivered message,
%% batches already in its mailbox (the inbox is suspended while they are queued, so
%% neither the sender nor distribution is measured) and the receiving processes
%% suspended (so they do not compete with it for a scheduler). Needs a distributed node; a
%% peer node stands in for the batches' sender. Uses only the wire format, so it
%% measures any version of convoy_inbox alike.
%%
%%   rebar3 as test compile
%%   erl -sname inbox_bench -noshell -pa _build/test/lib/convoy/ebin \
%%       -pa _build/test/lib/convoy/bench -eval 'convoy_inbox_bench:run(), halt().'
-module(convoy_inbox_bench).

-export([run/0, run/1]).

-define(INBOX, convoy_inbox_1).

-spec run() -> ok.
run() ->
    run(#{batches => 100, batch => 1000, repeat => 9}).

%% @doc Prints, per case, the median [min - max] ns per delivered message.
-spec run(#{batches := pos_integer(), batch := pos_integer(), repeat := pos_integer()}) -> ok.
run(Opts = #{batches := K, batch := N, repeat := R}) ->
    true = is_alive(),
    {ok, _} = application:ensure_all_started(convoy),
    {ok, Peer, From} = peer:start(#{name => peer:random_name(inbox_bench_from)}),
    Sinks = [spawn(fun sink/0) || _ <- lists:seq(1, N)],
    register(convoy_inbox_bench_sink, hd(Sinks)),
    io:format("convoy_inbox_bench ~p, OTP ~s, ~p schedulers~n",
              [Opts, erlang:system_info(otp_release), erlang:system_info(schedulers_online)]),
    Cases = [{one_pid, [{hd(Sinks), m} || _ <- lists:seq(1, N)]},
             {distinct_pids, [{S, m} || S <- Sinks]},
             {one_alias, [{alias_of(hd(Sinks)), m} || _ <- lists:seq(1, N)]},
             {registered_name, [{convoy_inbox_bench_sink, m} || _ <- lists:seq(1, N)]},
             {multicast_10, [{lists:sublist(Sinks, I * 10 + 1, 10), m} || I <- lists:seq(0, N div 10 - 1)]},
             {multicast_all, [{Sinks, m}]}],
    [report(Name, [measure(From, Entries, K, Sinks) || _ <- lists:seq(1, R)])
     || {Name, Entries} <- Cases],
    [exit(S, kill) || S <- Sinks],
    peer:stop(Peer),
    ok.

%% ns per delivered message for K batches of Entries.
measure(From, Entries, K, Sinks) ->
    Inbox = whereis(?INBOX),
    Batch = {'$convoy', 1, batch, From, Entries},
    Msgs = K * lists:sum([case To of
                              L when is_list(L) -> length(L);
                              _ -> 1
                          end || {To, _} <- Entries]),
    ok = sys:suspend(Inbox),
    [Inbox ! Batch || _ <- lists:seq(1, K)],
    [true = erlang:suspend_process(S) || S <- Sinks],
    T0 = erlang:monotonic_time(),
    ok = sys:resume(Inbox),
    _ = sys:get_state(Inbox, infinity),
    T1 = erlang:monotonic_time(),
    [true = erlang:resume_process(S) || S <- Sinks],
    [_ = sys:get_state(S, infinity) || S <- Sinks], % drained
    erlang:convert_time_unit(T1 - T0, native, nanosecond) / Msgs.

report(Name, Ns) ->
    S = lists:sort(Ns),
    io:format("~-16s ~7.1f ns/msg [~.1f - ~.1f]~n",
              [Name, lists:nth((length(S) + 1) div 2, S), hd(S), lists:last(S)]).

%% Drops everything; answers sys:get_state/1 (once everything before it is dropped).
sink() ->
    receive
        {alias, From} -> From ! {alias, self(), alias()}, sink();
        {system, From, get_state} -> gen:reply(From, sink), sink();
        _ -> sink()
    end.

alias_of(Sink) ->
    Sink ! {alias, self()},
    receive {alias, Sink, A} -> A end.
